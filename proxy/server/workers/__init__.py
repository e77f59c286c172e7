"""The process model: one proxy process, or a supervisor and its workers on one port.

supervisor    ``serve --workers N``: the supervisor and its workers on one port
worker        one worker's process: its socket on the shared port, its app, uvicorn on it
role          one worker among several: worker 0's collectors and mirror settings shared through files
lifetimes     no worker outlives its supervisor; the metrics directory's owner lock
guard         connection limits below the app, and the uvicorn server with graceful shutdown
"""
