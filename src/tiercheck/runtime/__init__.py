"""The plumbing every background job of an open store runs on: save handles and the failures
nobody saw, the store's thread pools, and how background threads report and stop."""
