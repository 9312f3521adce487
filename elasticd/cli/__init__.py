"""elasticctl, the operator's command line."""
