"""plan(): a whole model planned from its trace."""
