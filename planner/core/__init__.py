"""The planning problem of a trace, its solver graph, the candidates, the Plan type and the one solving core."""
