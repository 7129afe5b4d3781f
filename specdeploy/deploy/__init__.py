"""torch.export → ordered graph transforms → a cached, batched program (`DeployedModel`)."""
