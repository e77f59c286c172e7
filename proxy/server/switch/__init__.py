"""Moving a route's traffic from its baseline engine to a candidate, watched, rolled back by itself.

rollout       the guarded rollout: a route's share moves to a candidate step by step, rolls back by itself
rollouts      every route's rollout: the router's ticket, the observers, the lifespan, admin, /health, metrics
rolloutstate  a rollout's state document and its transitions (pure)
"""
