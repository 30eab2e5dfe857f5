"""TTFT and latency statistics computed from request timestamps; Prometheus export."""
