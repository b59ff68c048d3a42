"""What comes from and goes to disk: checkpoint loading and format, the tokenizer, audio input
files, the warm-up cache, progress bars."""
