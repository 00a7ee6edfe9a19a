"""enable(): each repeated block planned in place (the controller, block regions, recomputation)."""
