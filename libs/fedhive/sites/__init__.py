"""Sites: what a site agent reports about itself (heartbeats) and its serde."""
