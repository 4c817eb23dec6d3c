"""Model layers: TP linear, rotary, norms, embeddings, attention, logits and sampling."""
