"""The model: its configuration, the module tree in the published naming, and the math of each
component (audio/: mel, conformer, RNNT, codec; llm/: Nemotron-H; tts/: EAR-TTS). Components
compute through the op seam (ops.py) and know nothing of how a frame is executed (runtime/) or
streamed (streaming/)."""
