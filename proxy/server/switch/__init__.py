"""Moving a route's traffic from its baseline engine to a candidate, watched, rolled back by itself.

rollout       the guarded rollout: a route's share moves to a candidate step by step, rolls back by itself
rollouts      every route's rollout: the router's ticket, the observers, the lifespan, admin, /health, metrics
rolloutstate  a rollout's state document and its transitions (pure)
statedoc      a switch's state read defensively: damage starts it safe; default paths by listen address
swapstate     a swap's state document, its phases and what a restart does with it (pure)
swapwatch     the watch after a swap: the candidate against the baseline's window, unpaired (pure)
swaps         every route's swap in a serving process: the router's gate, admin, /health, metrics, the probe
swapqueue     one route's swap in a serving process: the phase, the hold queue, the counts, its report
swapper       the owner of a swap route's engines: launches, drives the phases, watches, swaps back
enginehost    the engines serve launches and the swaps' owners, in a thread of the owning process
"""
