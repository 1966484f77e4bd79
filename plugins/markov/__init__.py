"""The fused DSpark Markov loop: sequential draft sampling with the Markov head."""
