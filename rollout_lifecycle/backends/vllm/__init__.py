"""vLLM's driver: its endpoint table (``api``), the client (``client``: ``VLLMHTTPEngine``, which
declares vLLM's capabilities) and the launcher of vLLM servers (``launch``)."""
