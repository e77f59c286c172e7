"""The request path, in a request's order: where it goes, one attempt on one engine, the relay, the reply.

paths         request paths normalised once, before routing and forwarding
routing       request -> the serving engine, fallbacks and shadows; pure
attempts      one attempt on one engine, primary or shadow alike: made, run, recorded
relay         the upstream call and the stream relay (the hot path): ``Attempt``
upstream      per engine: the probing client and the relay's stream client
h1            the relay's HTTP/1.1 client: a keep-alive pool over plain asyncio connections
h1conn        one upstream connection: the parser's callbacks, backpressure, the client's own errors
output        where a relayed stream's bytes go, one ``Output`` per stream
hangup        the client hanging up: the watcher on ``receive()``, the guard around serving a request
responses     what the client gets from the proxy itself: the relayed response, errors, Server-Timing
rewrite       the engine's ``model`` value made the client's name again
llamatimings  a llama.cpp-shaped ``timings`` block measured by the proxy, for engines without one
"""
