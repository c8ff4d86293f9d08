"""What drives a hooked model: DP-SGD steps, K-FAC factors and the K-FAC optimizer, Jacobians,
the distributed paths and the check of a rule."""
