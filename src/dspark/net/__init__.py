"""HTTP: the one client (a deadline per request, bounded bodies) and the bounded server the
agent and the dashboard serve with."""
