"""Wing 1, the measuring proxy: a request's life top to bottom in ``app``, each stage a module of a sub-package.

The app and its routes sit on top; the sub-packages below import only downwards
(``record`` <- ``request`` <- ``mirror`` <- ``switch``; ``observe`` and ``workers`` over ``mirror``), as
``tests/system/test_structure.py`` holds them:

    compose       ``build_app``: the composition root, every stage built once, each a typed field of the ``Gateway``
    app           the gateway: one generation request, top to bottom like its life
    asgi          the ASGI shell: routes, the generation routes served before Starlette, health, metrics, lifespan
    admin         the admin endpoints (the admin key): the mirror's switch and rate, a route's rollout
    adminbody     an admin body read bounded (413 before reading it whole) and parsed bounded (deep JSON: 400)
    access        who may read /health's detail and /metrics (api_keys, health: public, metrics.access)
    passthrough   every other ``/v1/*`` route and ``/tokenize``, unbuffered, never mirrored
    record/       what every stage writes into: a request's result, the metrics, its context, the loop's health
    request/      the request path: routing, attempts, the relay (the hot path), the upstream client, responses
    mirror/       shadow copies, bounded and isolated; pairs matched and compared; the comparison log
    switch/       moving a route from one engine to another: the guarded rollout and its shared state
    observe/      what the proxy reports beside the traffic: traces, request log, engine state, diagnosis, traffic
    workers/      the process model: ``serve --workers N``, each worker's role, lifetimes, the uvicorn guard
"""
