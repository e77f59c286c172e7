"""Quality: do the engines answer alike? Token agreement and task accuracy, each with its interval. docs/bench.md.

Below ``run`` (which drives its phases after the timed cells) and beside ``verdict`` (which reads its figures):
it imports neither, nor ``live``, ``report``, ``cli`` or ``server``.

    divergence   pure: KL over the top-k + rest (a lower bound), same top token, first part, bootstrap over prompts
    agreerun     the agreement phase: tokenize, greedy paths, every engine teacher-forced along the baseline's path
    evalset      ``--eval FILE.jsonl``: items, matchers (exact, regex, number), each engine's answers scored
    liveprompts  token agreement on the prompts a comparison log recorded, measured on two engines on demand
    phases       the run's phases engine by engine, from plain things ``run`` hands over (``--agreement``, ``--eval``)
    readout      records in, figures out: agreement and accuracy per candidate, the bounds, the lines that say them
"""
