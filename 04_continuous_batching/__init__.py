"""Stage 04: continuous batching. Before every step a scheduler picks the sequences; one forward pass serves them."""
