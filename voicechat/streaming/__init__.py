"""Conversations over time: the frame engine and its per-frame state, the streaming session that
turns frames into events, offline generation, the ASR session, chunked speech output, prompt
states and the profiler."""
