"""Scheduler, request state, tokenizer manager and the messages between them."""
