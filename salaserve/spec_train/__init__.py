"""Training EAGLE-3 draft heads (`salaserve train-draft`): an application over the model and the engine."""
