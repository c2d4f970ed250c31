"""Scale out on Ray Serve: engine replicas (`replica.EngineReplica`) behind one
OpenAI-compatible ingress (`ingress.OpenAIIngress`, the same FastAPI app as `moestream
serve`), routed by prefix-cache affinity (`router.PrefixAffinityRouter`), with per-replica
metrics merged under a `replica` label (`metrics`). `deploy.build_ray_app` binds them;
`deploy.serve_ray` is `moestream serve --ray`.

Needs the optional extra: `pip install -e ".[ray]"`.
"""
