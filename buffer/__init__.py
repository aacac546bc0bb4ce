"""The buffer role: admission control, dispatch to scorers, batches under the staleness bound."""
