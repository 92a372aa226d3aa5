"""The client side of `lmfoundry bench`: a load generator for any OpenAI-compatible server and the
plot of its results. Kept out of the runtime: it measures servers (ours or a peer's), it does not
serve."""
