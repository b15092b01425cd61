// Progressive enhancement of the server-rendered tables: without JavaScript every sort and
// filter is a link or a form the server answers; with it, a table that holds every matching
// row (data-complete="true") sorts and filters in place.
(function () {
  "use strict";
  function rows(table) { return Array.prototype.slice.call(table.tBodies[0].rows); }

  document.querySelectorAll("table[data-complete='true'] th[data-sort] a").forEach(function (link) {
    link.addEventListener("click", function (event) {
      var th = link.parentElement, table = th.closest("table"), key = th.dataset.sort;
      var numeric = th.dataset.type === "num";
      var order = th.getAttribute("aria-sort") === "descending" ? "asc"
        : th.getAttribute("aria-sort") === "ascending" ? "desc"
        : (["risk", "node_risk", "tier"].indexOf(key) >= 0 ? "desc" : "asc");
      var sign = order === "desc" ? -1 : 1;
      var sorted = rows(table).sort(function (a, b) {
        var x = a.getAttribute("data-s-" + key), y = b.getAttribute("data-s-" + key);
        if (numeric) { x = parseFloat(x); y = parseFloat(y); }
        if (x < y) return -sign;
        if (x > y) return sign;
        return parseInt(a.dataset.rank, 10) - parseInt(b.dataset.rank, 10);
      });
      var body = table.tBodies[0];
      sorted.forEach(function (r) { body.appendChild(r); });
      table.querySelectorAll("th[aria-sort]").forEach(function (h) { h.removeAttribute("aria-sort"); });
      th.setAttribute("aria-sort", order === "desc" ? "descending" : "ascending");
      var url = new URL(link.href);
      url.searchParams.set("sort", key);
      url.searchParams.set("order", order);
      history.replaceState(null, "", url.pathname + url.search);
      event.preventDefault();
    });
  });

  document.querySelectorAll("input[data-live]").forEach(function (input) {
    var table = document.getElementById(input.dataset.live);
    if (!table || table.dataset.complete !== "true") return;
    var shown = document.getElementById("n-shown");
    input.addEventListener("input", function () {
      var needle = input.value.trim().toLowerCase(), n = 0;
      rows(table).forEach(function (r) {
        var hit = !needle || (r.dataset.search || "").indexOf(needle) >= 0;
        r.hidden = !hit;
        if (hit) n += 1;
      });
      if (shown) shown.textContent = n.toLocaleString("en-US");
    });
  });

  document.querySelectorAll("select[data-autosubmit]").forEach(function (select) {
    select.addEventListener("change", function () { select.form.submit(); });
  });
})();
