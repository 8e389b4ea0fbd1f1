//! Rendering of a MapState for people: indented tree, JSON, Graphviz dot.
