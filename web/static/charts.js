/* Draws the dashboard charts from the inert JSON block #chart-data (Chart.js, vendored). */
(function () {
  "use strict";
  var node = document.getElementById("chart-data");
  if (!node || typeof Chart === "undefined") { return; }
  var data = JSON.parse(node.textContent);
  var base = { responsive: true, maintainAspectRatio: false, animation: false,
    plugins: { legend: { position: "bottom" } } };
  function numbers(list) { return list.map(function (v) { return parseFloat(v); }); }
  function draw(id, config) {
    var canvas = document.getElementById(id);
    if (canvas) { new Chart(canvas, config); }
  }
  draw("chart-requests", { type: "bar", options: base, data: { labels: data.labels,
    datasets: [{ label: "requests", data: data.requests, backgroundColor: "#2f6fde" }] } });
  var stacked = Object.assign({}, base, { scales: { x: { stacked: true }, y: { stacked: true } } });
  draw("chart-layers", { type: "bar", options: stacked, data: { labels: data.labels, datasets: [
    { label: "semantic hits", data: data.semantic, backgroundColor: "#7a5af8" },
    { label: "cached prefix", data: data.cached, backgroundColor: "#12b76a" },
    { label: "uncached input", data: data.uncached, backgroundColor: "#f79009" },
    { label: "output", data: data.output, backgroundColor: "#2f6fde" }] } });
  if (data.semantic_rate) {
    var percent = Object.assign({}, base, { scales: { y: { min: 0, max: 100 } } });
    draw("chart-hit-rates", { type: "line", options: percent, data: { labels: data.labels,
      datasets: [
        { label: "semantic (share of requests)", data: data.semantic_rate,
          borderColor: "#7a5af8", backgroundColor: "#7a5af8" },
        { label: "prefix (share of engine prompt tokens)", data: data.prefix_rate,
          borderColor: "#12b76a", backgroundColor: "#12b76a" }] } });
  }
  var spendType = document.getElementById("chart-spenders") ? "bar" : "line";
  draw(spendType === "bar" ? "chart-spenders" : "chart-spend", { type: spendType, options: base,
    data: { labels: data.labels, datasets: [
      { label: "billed", data: numbers(data.billed), borderColor: "#2f6fde",
        backgroundColor: "#2f6fde" },
      { label: "list price", data: numbers(data.list), borderColor: "#98a2b3",
        backgroundColor: "#98a2b3" }] } });
}());
