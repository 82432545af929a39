"""The runner's backends behind the :mod:`warmcap.contracts.backends` interfaces, and the forward
context it hands the model."""
