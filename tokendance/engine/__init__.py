"""Engine layer: requests, scheduler, model runner and the step loop."""
