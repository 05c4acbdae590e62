"""The oncemore Airflow plugin: the oncemore page (a FastAPI app mounted in the api-server at
/oncemore) and its entry in the UI's navigation, which embeds it."""

from airflow.plugins_manager import AirflowPlugin

from oncemore_airflow.ui import URL_PREFIX, app


class OncemorePlugin(AirflowPlugin):
    name = "oncemore"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "oncemore"}]
    external_views = [{
        "name": "oncemore",
        "href": URL_PREFIX.lstrip("/") + "/",
        "url_route": "oncemore",
        "destination": "nav",
        "nav_top_level": True,  # what on-call opens first: a button of its own, not a submenu
    }]
