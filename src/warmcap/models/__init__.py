"""Model code over the runner's paged attention: loader, registry, Llama family, presets."""
