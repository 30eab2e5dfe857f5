"""Scale-out on Ray Serve: engine replicas, each an AsyncEngine in a Ray actor, behind a request
router that sends a request to the replica whose prefix cache holds the most of its first
blocks, and one ingress serving the same OpenAI API as the single-process server.

Ray is an optional dependency (the `ray` extra): only this package imports it, and only its
Ray-facing modules (`ray`, `replica`, `router`, `client`, `cli` when it runs); `routing` is the
decision alone, testable without Ray.
"""
