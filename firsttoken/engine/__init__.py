"""The step loop, the offline LLM API, the asyncio front end and output processing."""
