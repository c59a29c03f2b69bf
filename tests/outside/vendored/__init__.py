"""Model code copied from other projects (Apache-2.0), each file naming its origin and edits."""
