// Live refresh: with the "live" box ticked, re-read the page every 10 s and swap its main
// part in place. Everything on the page works without this script.
(function () {
  "use strict";
  var box = document.getElementById("live");
  if (!box || !window.fetch || !window.DOMParser) { return; }
  var key = "kb-live";
  box.checked = window.localStorage.getItem(key) !== "off";
  box.addEventListener("change", function () {
    window.localStorage.setItem(key, box.checked ? "on" : "off");
  });
  window.setInterval(function () {
    if (!box.checked || document.hidden) { return; }
    if (document.activeElement && document.activeElement.form) { return; } // typing in a form
    if (document.querySelector("input[type=checkbox][name=task_id]:checked")) { return; }
    window.fetch(window.location.href, { credentials: "same-origin" })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (!html) { return; }
        var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("main");
        var current = document.getElementById("main");
        if (fresh && current) { current.innerHTML = fresh.innerHTML; }
      })
      .catch(function () { /* the next tick tries again */ });
  }, 10000);
})();
