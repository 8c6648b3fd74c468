"""The testing kit: fp64 oracle, random step factories, mock backend, conformance suite."""
