"""The router: the OpenAI API in front of prefill and decode instances (never imports torch)."""
