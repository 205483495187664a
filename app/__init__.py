"""meshpact.app: the Streamlit dashboard."""
