"""Ray Tune sweeps over training configs (`drelay tune`): config, trials, runner, summary."""
