"""The `replicator demo`: a small ResNet trained on scikit-learn's digits, on one replica and on many."""
