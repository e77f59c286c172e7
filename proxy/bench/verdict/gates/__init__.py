"""The gates before any speed is judged, in the verdict's order: parity, data, memory. Pure.

Each returns reasons; a reason whose outcome is in ``inputs.FAILS`` fails its gate, and the verdict stops there.

    paritygate  the same input and work on both engines: prompt tokens, sampling, lengths, context, quantization
    datagate    enough answered requests and repeats, a shared cell, cache phases as labelled, one-read bursts
    memorygate  the candidate's memory peak against the budget; an excess a memory-share setting makes
"""
