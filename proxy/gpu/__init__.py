"""GPU reading behind one seam, importable without building the proxy's app. docs/metrics.md.

nvml         the seam: ``NvmlReader`` (devices, processes, driver) and the real ``pynvml`` reader; an
             ``Opener`` is what every user takes, so tests replay recorded readings
attribution  GPU processes -> engines, through /proc: an engine's pid and descendants, or its listening port
device       the machine's GPUs as a run records them: model, count, driver, CUDA
memory       a reading now (a launch, a diagnosis): the devices and one engine's processes
monitor      the proxy's sampler thread and the Prometheus collector that reads only its cache
scraped      GPU memory as a running proxy's ``/metrics`` reports it (per engine or per device)
"""
