"""The engine: requests are scheduled, drafts proposed, verified, accepted and committed each step."""
