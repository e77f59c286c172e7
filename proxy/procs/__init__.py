"""Engines as processes, whoever starts them (the embedded default, ``bench --launch``, ``tune``, ``serve``):

process       one engine command as a process: own session, log file, readiness against a deadline, stop
launch        starting an engine from its command line (``{port}``), ready by its kind's signal, with its
              GPU memory moments
"""
