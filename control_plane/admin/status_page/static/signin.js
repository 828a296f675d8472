// Sign-in: the token goes to POST /v1/session as JSON (the admin API takes no form posts);
// the answer sets the session cookie and the page loads.
"use strict";
document.getElementById("signin").addEventListener("submit", async (event) => {
  event.preventDefault();
  const error = document.getElementById("error");
  const button = event.target.querySelector("button");
  error.hidden = true;
  button.disabled = true;
  try {
    const resp = await fetch("/v1/session", {
      method: "POST",
      headers: {"Content-Type": "application/json"},
      body: JSON.stringify({token: document.getElementById("token").value}),
      credentials: "same-origin",
    });
    if (resp.ok) {
      location.replace("/" + location.hash);
      return;
    }
    let message = "Signing in failed (" + resp.status + ")";
    try { message = (await resp.json()).message || message; } catch (e) { /* not JSON */ }
    error.textContent = message;
    error.hidden = false;
  } catch (e) {
    error.textContent = "The control plane did not answer: " + e;
    error.hidden = false;
  } finally {
    button.disabled = false;
  }
});
