"""Models (the embedded default, tiny test models, hub loading), datasets, rewards and held-out evaluation."""
