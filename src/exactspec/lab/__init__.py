"""The rejection-sampling lab: continuous rejection sampling, the numbers behind `exactspec lab`, and the figures."""
