"""The Triton models behind the orchestrator, around their engines: requests in, responses out."""
