"""Engines as processes, whoever starts them (the embedded default, ``bench --launch``, ``tune``, ``serve``):

process       one engine command as a process: own session, log file, readiness against a deadline, stop
members       /proc: the live members of a process group, a process's start time
leftovers     no engine outlives enginemeter: the parent-death signal, the record of running engines, the sweep
launch        starting an engine from its command line (``{port}``), ready by its kind's signal, with its
              GPU memory moments
"""
