"""Mixture of experts: router, dispatcher, experts, losses and the layer that joins them."""
