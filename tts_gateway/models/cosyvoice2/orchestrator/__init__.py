"""One request through the stages: prompt, LLM tokens, streamed chunks of audio."""
