// Search results quote the page around the words found. Sphinx reads that
// text from the page's [role="main"] element, which in this theme also
// holds the article's header buttons (download, full screen, the colour
// mode menu: "System Settings Light Dark"), the copy of the title and the
// table of contents made for printing ("Contents", then every section) and
// the "on this page" sidebar; leave them out of the excerpt, which then
// quotes the article alone (tests/repo/docs_site_check.py checks this).
(function () {
  const HIDDEN =
    ".bd-header-article, .d-print-none, .prev-next-area, footer, .onlyprint, .bd-sidebar-secondary";
  function patch() {
    if (typeof Search === "undefined" || Search._excerptsPatched) return;
    const htmlToText = Search.htmlToText;
    Search.htmlToText = (htmlString, anchor) => {
      const doc = new DOMParser().parseFromString(htmlString, "text/html");
      doc.querySelectorAll(HIDDEN).forEach((el) => el.remove());
      return htmlToText(doc.documentElement.outerHTML, anchor);
    };
    Search._excerptsPatched = true;
  }
  patch();
  document.addEventListener("DOMContentLoaded", patch);
})();
