"""The publisher's HTTP side: the app, its routes and middlewares, request bodies and the
upload budget, readiness, the wire models and the committed OpenAPI document with its links,
and the server that runs it all.
"""
