"""Privacy bookkeeping: Poisson sampling, the accountant, and the audit of the mechanism."""
